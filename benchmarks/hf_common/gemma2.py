"""gemma2: test_modeling_common's tests on a tiny config (the tree's tests/models/gemma2/test_modeling_gemma2.py)."""
import unittest

import transformers

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester


class Gemma2ModelTester(CausalLMModelTester):
    config_class = transformers.Gemma2Config
    base_model_class = transformers.Gemma2Model
    causal_lm_class = transformers.Gemma2ForCausalLM
    sequence_classification_class = getattr(transformers, "Gemma2ForSequenceClassification", None)
    token_classification_class = getattr(transformers, "Gemma2ForTokenClassification", None)


class Gemma2ModelTest(CausalLMModelTest, unittest.TestCase):
    model_tester_class = Gemma2ModelTester
