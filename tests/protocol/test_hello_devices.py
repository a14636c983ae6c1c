"""The hello's ``devices`` (protocol/messages.py ``Devices``): a peer's claims about its
devices are input, bounded and checked on receipt; a hello without them stays valid."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from protocol import constants as c
from protocol.errors import ProtocolError
from protocol.messages import ComputeCost, DeviceReport, Devices, Hello, decode_link_message

GIB = 2**30


def _devices() -> Devices:
    return Devices(
        (
            DeviceReport("CUDA0", "GPU", 20 * GIB, 24 * GIB, ComputeCost(1e-4, 2e-5, 4096)),
            DeviceReport("CPU", "CPU", 60 * GIB, 64 * GIB, ComputeCost(1e-3, 2e-4, 4096)),
        ),
        stage_device="CUDA0",
        experts_on_cpu=True,
    )


def _hello_with(devices: object) -> bytes:
    doc = msgpack.unpackb(Hello(listen=None).encode())
    doc["devices"] = devices
    return msgpack.packb(doc)


def test_devices_round_trip_in_a_hello_and_a_hello_without_them_still_decodes() -> None:
    hello = Hello(listen="ws://127.0.0.1:1", memory_budget_bytes=5, devices=_devices())
    got = decode_link_message(hello.encode())
    assert isinstance(got, Hello) and got.devices == _devices()
    assert got.devices.get("CPU") is not None and got.devices.get("Metal") is None
    plain = decode_link_message(Hello(listen=None).encode())
    assert isinstance(plain, Hello) and plain.devices is None


def _wire(**change: Any) -> dict[str, Any]:
    doc = _devices().to_wire()
    doc.update(change)
    return doc


def _zero_speed() -> dict[str, Any]:
    return {"decode_s_per_layer": 0.0, "prefill_s_per_layer": 1e-5, "layer_bytes": 10}


def _device(**change: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": "CUDA0", "type": "GPU", "free_bytes": 1, "total_bytes": 2}
    d.update(change)
    return d


@pytest.mark.parametrize(
    "devices",
    [
        pytest.param([], id="not-a-map"),
        pytest.param({"list": [_device()], "stage": "CUDA0"}, id="missing-key"),
        pytest.param(_wire(extra=1), id="extra-key"),
        pytest.param(_wire(list=[]), id="empty-list"),
        pytest.param(
            _wire(list=[_device(name=f"d{i}") for i in range(c.MAX_DEVICES + 1)]), id="too-many"
        ),
        pytest.param(_wire(list=[_device(), _device()], stage="CUDA0"), id="listed-twice"),
        pytest.param(_wire(stage="ROCm0"), id="stage-not-listed"),
        pytest.param(_wire(experts_on_cpu=1), id="experts-flag-not-bool"),
        pytest.param(_wire(list=[_device(free_bytes=3)], stage="CUDA0"), id="free-over-total"),
        pytest.param(_wire(list=[_device(free_bytes=-1)], stage="CUDA0"), id="negative"),
        pytest.param(_wire(list=[_device(total_bytes=2**63)], stage="CUDA0"), id="too-large"),
        pytest.param(_wire(list=[_device(free_bytes=True)], stage="CUDA0"), id="bool-bytes"),
        pytest.param(_wire(list=[_device(type="TPU")], stage="CUDA0"), id="unknown-type"),
        pytest.param(
            _wire(list=[_device(name="CUDA0\x1b[2J")], stage="CUDA0\x1b[2J"), id="control-chars"
        ),
        pytest.param(
            _wire(list=[_device(name="x" * 65)], stage="x" * 65), id="name-too-long"
        ),
        pytest.param(_wire(list=[_device(name="Gerät")], stage="Gerät"), id="non-ascii"),
        pytest.param(_wire(list=[_device(path="/x")], stage="CUDA0"), id="device-extra-key"),
        pytest.param(
            _wire(list=[_device(compute=_zero_speed())], stage="CUDA0"),
            id="bad-compute",
        ),
    ],
)
def test_a_malformed_devices_advertisement_is_refused(devices: object) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_link_message(_hello_with(devices))
    assert info.value.code == "malformed_message"


def test_the_largest_valid_list_fits_a_link_message() -> None:
    many = tuple(
        DeviceReport(f"{'D' * 60}{i:02d}", "GPU", GIB, 2 * GIB, ComputeCost(1e-4, 1e-5, 10))
        for i in range(c.MAX_DEVICES)
    )
    hello = Hello(listen=None, devices=Devices(many, many[0].name))
    assert len(hello.encode()) <= c.DEFAULT_LIMITS.max_control_payload
    got = decode_link_message(hello.encode())
    assert isinstance(got, Hello) and got.devices is not None and len(got.devices.devices) == 16
