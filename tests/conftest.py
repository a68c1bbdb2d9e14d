import os

# Triton kernels run on the CPU through the interpreter (set before triton is imported anywhere).
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover
        pass

import pytest  # noqa: E402
import torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    torch.compiler.reset()  # every test compiles from scratch: no recompile limit shared across tests
