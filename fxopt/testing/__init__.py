"""fxopt.testing: equivalence tests you run on your own passes.

* :func:`assert_equivalent` compares a rewritten graph with the original (float64
  reference, per-dtype tolerances, first diverging node);
* :func:`check_pass` runs a pass on a graph and asserts equivalence in one call;
* :mod:`fxopt.testing.zoo` holds model-zoo cases, :mod:`fxopt.testing.strategies` the
  hypothesis strategies, :mod:`fxopt.testing.minimize` the test-case minimizer;
* the pytest plugin (:mod:`fxopt.testing.plugin`, loaded automatically) provides the
  ``fx_case`` and ``check_pass`` fixtures and ``--fxopt-artifacts=DIR``.
"""

from fxopt.errors import (
    EquivalenceError,
    NondeterministicReferenceError,
    ReferenceFailureError,
    StructureMismatchError,
)
from fxopt.testing.check import check_pass, write_artifacts
from fxopt.testing.equivalence import Divergence, assert_equivalent, first_divergence, pair_nodes
from fxopt.testing.inputs import InputSpec, input_specs, random_inputs
from fxopt.testing.minimize import minimize, node_count, pass_breaks
from fxopt.testing.repro import repro_source, write_repro
from fxopt.testing.zoo import ZOO, CaseInstance, ZooCase

__all__ = [
    "ZOO", "CaseInstance", "Divergence", "EquivalenceError", "InputSpec",
    "NondeterministicReferenceError", "ReferenceFailureError", "StructureMismatchError",
    "ZooCase", "assert_equivalent", "check_pass", "first_divergence", "input_specs", "minimize",
    "node_count", "pair_nodes", "pass_breaks", "random_inputs", "repro_source", "write_artifacts",
    "write_repro",
]
