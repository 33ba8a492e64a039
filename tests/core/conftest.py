"""Core tests run with `jax_numpy_rank_promotion="raise"` so silent broadcasting fails (rlax)."""

import jax
import pytest

# Only inside each core test (the fixture below): a module-level update would leak "raise"
# into every test collected after this file and break code outside core that broadcasts.


@pytest.fixture(autouse=True)
def _raise_on_rank_promotion():
    previous = jax.config.jax_numpy_rank_promotion
    jax.config.update("jax_numpy_rank_promotion", "raise")
    yield
    jax.config.update("jax_numpy_rank_promotion", previous)
