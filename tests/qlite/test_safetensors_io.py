"""The sharded writer."""
import pytest
import torch

from qlite.safetensors_io import TensorSpec, write_sharded


def test_an_error_mid_write_closes_the_tensor_generator_before_it_propagates(tmp_path):
    """A Ctrl-C while writing: the producer's cleanup (a progress bar's last line) runs before the
    caller prints its error, not later when the generator is collected."""
    events = []

    def tensors():
        try:
            for i in range(3):
                yield f"t{i}", torch.zeros(4)
        finally:
            events.append("closed")

    def progress(name):
        raise KeyboardInterrupt

    specs = [TensorSpec(f"t{i}", torch.float32, (4,)) for i in range(3)]
    gen = tensors()  # held here, so only write_sharded can have closed it
    with pytest.raises(KeyboardInterrupt):
        write_sharded(tmp_path, specs, gen, progress=progress)
    assert events == ["closed"]
