import pytest
import torch


def pytest_report_header(config):
    import sparse_attn

    return (f"sparse_attn from {sparse_attn.__file__} (CUDA backend built: "
            f"{sparse_attn.built_with_cuda}); torch {torch.__version__}, CUDA available: "
            f"{torch.cuda.is_available()}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
