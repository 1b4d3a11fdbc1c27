"""qwen2: test_modeling_common's tests on a tiny config (the tree's tests/models/qwen2/test_modeling_qwen2.py)."""
import unittest

import transformers

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester


class Qwen2ModelTester(CausalLMModelTester):
    config_class = transformers.Qwen2Config
    base_model_class = transformers.Qwen2Model
    causal_lm_class = transformers.Qwen2ForCausalLM
    sequence_classification_class = getattr(transformers, "Qwen2ForSequenceClassification", None)
    token_classification_class = getattr(transformers, "Qwen2ForTokenClassification", None)


class Qwen2ModelTest(CausalLMModelTest, unittest.TestCase):
    model_tester_class = Qwen2ModelTester
