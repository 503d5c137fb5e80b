"""jaxvt: GGUF language models as pure JAX functions, larger than the accelerator they run on."""

from jaxvt.engine import Engine, load  # noqa: F401
from jaxvt.errors import JaxvtError  # noqa: F401
from jaxvt.sampling import SamplingParams  # noqa: F401

__version__ = "0.1.0"
