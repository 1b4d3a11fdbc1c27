"""mistral: test_modeling_common's tests on a tiny config (the tree's tests/models/mistral/test_modeling_mistral.py)."""
import unittest

import transformers

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester


class MistralModelTester(CausalLMModelTester):
    config_class = transformers.MistralConfig
    base_model_class = transformers.MistralModel
    causal_lm_class = transformers.MistralForCausalLM
    sequence_classification_class = getattr(transformers, "MistralForSequenceClassification", None)
    token_classification_class = getattr(transformers, "MistralForTokenClassification", None)


class MistralModelTest(CausalLMModelTest, unittest.TestCase):
    model_tester_class = MistralModelTester
