"""Session fixtures: tiny random checkpoints (see tiny_models.py)."""
from pathlib import Path

import pytest

from tiny_models import CONFIGS, make_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def tiny_variant(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, make_checkpoint(tmp_path_factory.mktemp(name) / "ckpt", **CONFIGS[name])

