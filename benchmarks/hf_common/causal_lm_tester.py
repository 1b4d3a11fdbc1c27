"""A decoder-only model tester and the test class that mixes in test_modeling_common's ModelTesterMixin
(placed at tests/causal_lm_tester.py of the tree). Sizes follow the common tiny test model: batch 13,
7 tokens, 2 layers, hidden 32, 2 heads; the tests themselves are all test_modeling_common's, plus a
forward per head class."""
import os
from inspect import signature

import torch

from .test_modeling_common import GenerationTesterMixin, ModelTesterMixin, ids_tensor, require_torch, torch_device

WINDOW = "ATTNZOO_HF_SLIDING_WINDOW"


class CausalLMModelTester:
    config_class = base_model_class = causal_lm_class = None
    sequence_classification_class = token_classification_class = None

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, use_input_mask=True,
                 vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, intermediate_size=37, hidden_act="gelu", max_position_embeddings=512,
                 type_sequence_label_size=2, initializer_range=0.02, num_labels=3, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, num_experts_per_tok=2, num_experts=8):
        settings = dict(locals())
        del settings["self"], settings["parent"]
        self.parent = parent
        self.__dict__.update(settings)
        self.head_dim = hidden_size // num_attention_heads
        # hf_common_tests.py --sliding-window W: a window that binds at 7 tokens (the configs' own do not)
        window = os.environ.get(WINDOW)
        if window:   # Qwen 2 windows the layers from max_window_layers on
            self.sliding_window, self.use_sliding_window, self.max_window_layers = int(window), True, 0

    @property
    def all_model_classes(self):
        return [c for c in (self.base_model_class, self.causal_lm_class, self.sequence_classification_class,
                            self.token_classification_class) if c is not None]

    def get_config(self):
        """The config class's own arguments, from this tester's attributes of the same name (or of the
        name the config's attribute_map gives it)."""
        aliases = {canonical: alias for alias, canonical in self.config_class.attribute_map.items()}
        kwargs = {}
        for name in [*signature(self.config_class.__init__).parameters, "pad_token_id"]:
            if name != "self" and hasattr(self, name):
                kwargs[name] = getattr(self, name)
            elif name in aliases and hasattr(self, aliases[name]):
                kwargs[name] = getattr(self, aliases[name])
        return self.config_class(**kwargs)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        # a lower-triangular mask: every row but the last has padding on the right
        mask = torch.tril(torch.ones_like(input_ids)).to(torch_device) if self.use_input_mask else None
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


@require_torch
class CausalLMModelTest(ModelTesterMixin, GenerationTesterMixin):
    model_tester_class = None
    all_model_classes = None

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        if self.all_model_classes is None:
            self.all_model_classes = self.model_tester.all_model_classes

    def _inputs(self):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.num_labels = 3
        return config, inputs["input_ids"]

    def test_model(self):
        config, input_ids = self._inputs()
        model = self.model_tester.base_model_class(config).to(torch_device).eval()
        out = model(input_ids, attention_mask=torch.ones_like(input_ids))
        self.assertEqual(out.last_hidden_state.shape, (*input_ids.shape, self.model_tester.hidden_size))

    def test_sequence_classification_model(self):
        if self.model_tester.sequence_classification_class is None:
            self.skipTest("no sequence classification head")
        config, input_ids = self._inputs()
        model = self.model_tester.sequence_classification_class(config).to(torch_device).eval()
        labels = ids_tensor([self.model_tester.batch_size], 3)
        out = model(input_ids, attention_mask=input_ids.ne(1), labels=labels)
        self.assertEqual(out.logits.shape, (self.model_tester.batch_size, 3))

    def test_token_classification_model(self):
        if self.model_tester.token_classification_class is None:
            self.skipTest("no token classification head")
        config, input_ids = self._inputs()
        model = self.model_tester.token_classification_class(config).to(torch_device).eval()
        labels = ids_tensor(list(input_ids.shape), 3)
        out = model(input_ids, attention_mask=input_ids.ne(1), labels=labels)
        self.assertEqual(out.logits.shape, (*input_ids.shape, 3))
