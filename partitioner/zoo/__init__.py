"""The model zoo. Importing this package registers every builder with ``model_spec``.

``hf`` imports nothing from ``transformers`` until an ``hf-*`` model is built.
"""
from partitioner.zoo import bert, gpt, hf, llama, mlp, moe, resnet, unet  # noqa: F401
