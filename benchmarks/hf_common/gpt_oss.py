"""gpt_oss: test_modeling_common's tests on a tiny config (the tree's tests/models/gpt_oss/test_modeling_gpt_oss.py)."""
import unittest

import transformers

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester


class GptOssModelTester(CausalLMModelTester):
    config_class = transformers.GptOssConfig
    base_model_class = transformers.GptOssModel
    causal_lm_class = transformers.GptOssForCausalLM
    sequence_classification_class = getattr(transformers, "GptOssForSequenceClassification", None)
    token_classification_class = getattr(transformers, "GptOssForTokenClassification", None)

    def __init__(self, parent, **kwargs):
        # the experts' grouped matmul on CPU wants 16-byte aligned rows
        super().__init__(parent, **{"intermediate_size": 32, **kwargs})


class GptOssModelTest(CausalLMModelTest, unittest.TestCase):
    model_tester_class = GptOssModelTester
