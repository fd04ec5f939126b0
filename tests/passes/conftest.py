"""Every rewrite test starts from an empty Dynamo cache: tests compile closures that share a code
object, and leftover cache entries would count against Dynamo's recompile limit."""
import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
