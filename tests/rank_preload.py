"""Imported by the suite's fork server (tests/conftest.py): the Hugging Face model classes the
spawned ranks build, loaded once instead of in every rank."""
from partitioner.zoo.hf import import_model_classes

import_model_classes()
