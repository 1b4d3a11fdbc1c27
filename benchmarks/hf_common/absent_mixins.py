"""What test_modeling_common imports from transformers' tests/generation/ and tests/exporters/, which the
sdist lacks: empty mixins, so its ModelTesterMixin's own tests run and no generate or export test does."""


class GenerationTesterMixin:
    pass


class ExportTesterMixin:
    pass
