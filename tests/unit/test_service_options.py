"""The service hands its reconciler the options of the same names: none may be missing."""

from __future__ import annotations

from dataclasses import MISSING, fields

from coordinator.service.control.reconciler import ReconcilerSettings
from coordinator.service.runner import ServiceOptions


def test_every_setting_the_reconciler_needs_is_a_service_option() -> None:
    options = {f.name: f.type for f in fields(ServiceOptions)}
    for setting in fields(ReconcilerSettings):
        if setting.default is MISSING or setting.name in options:
            assert options.get(setting.name) == setting.type, setting.name


def test_the_operators_member_settings_reach_the_reconciler() -> None:
    shared = {f.name for f in fields(ReconcilerSettings)} & {f.name for f in fields(ServiceOptions)}
    assert {"grace", "member_ttl", "member_connect_timeout", "max_workers"} <= shared
