"""The Pallas kernels a traced function launches, read off its jaxpr (tests only)."""

from __future__ import annotations

import jax
from jax.extend import core as jex


def _names(jaxpr) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params["name"]))
        else:
            for sub in jex.jaxprs_in_params(eqn.params):
                names += _names(sub)
    return names


def pallas_kernel_names(fn, *args, **make_jaxpr_kwargs) -> list[str]:
    """The name of every pallas_call fn(*args) makes, in program order, once per call (a jitted
    function called twice counts twice)."""
    return _names(jax.make_jaxpr(fn, **make_jaxpr_kwargs)(*args).jaxpr)
