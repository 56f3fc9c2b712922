"""The model zoo. Importing this package registers every builder with ``model_spec``."""
from partitioner.zoo import gpt  # noqa: F401
