"""Each kind of rendezvous failure has an exit status of its own, which a caller can trust."""

from __future__ import annotations

import pytest

from coordinator.exit_codes import EXIT_ETCD_UNAVAILABLE, EXIT_INTERRUPTED, EXIT_USAGE
from coordinator.rendezvous import errors
from coordinator.rendezvous.errors import RendezvousError


def test_every_failure_has_its_own_exit_code_apart_from_the_shared_ones() -> None:
    kinds = [k for k in vars(errors).values() if isinstance(k, type) and issubclass(k, Exception)]
    codes = [kind.exit_code for kind in kinds]
    assert len(set(codes)) == len(codes) == 7
    assert not {EXIT_USAGE, EXIT_ETCD_UNAVAILABLE, EXIT_INTERRUPTED} & set(codes)


def test_a_failure_without_an_exit_code_is_refused_where_it_is_declared() -> None:
    with pytest.raises(TypeError, match="exit_code"):

        class Forgot(RendezvousError):  # declaring it is what fails
            pass
