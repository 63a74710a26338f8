"""The in-process gRPC server both client test files run their scriptable fakes behind."""

from __future__ import annotations

import unittest
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass
class RecordedCall:
    method: str
    request: object
    metadata: list[tuple[str, str]]


class FakeServerTestCase(unittest.TestCase):
    """One in-process server per test class whose every method forwards to the class's current
    `fake`, so one server serves all tests while each test gets a fresh fake (set in setUp).

    Subclasses set `servicer_base` (the generated *Servicer class), `add_servicer` (the generated
    add_*Servicer_to_server, as a staticmethod) and `methods` (the RPC names to forward).
    """

    servicer_base: type
    add_servicer: Callable[[Any, grpc.Server], None]
    methods: Sequence[str]
    server: grpc.Server
    target: str
    fake: Any

    @classmethod
    def setUpClass(cls) -> None:
        def forward(name: str):
            return lambda self, request, context: getattr(cls.fake, name)(request, context)

        delegate = type("Delegate", (cls.servicer_base,), {name: forward(name) for name in cls.methods})
        cls.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        cls.add_servicer(delegate(), cls.server)
        port = cls.server.add_insecure_port("127.0.0.1:0")
        cls.server.start()
        cls.target = f"127.0.0.1:{port}"

    @classmethod
    def tearDownClass(cls) -> None:
        cls.server.stop(grace=None)

    def only_call(self, method: str) -> RecordedCall:
        self.assertEqual([c.method for c in self.fake.calls], [method])
        return self.fake.calls[0]
