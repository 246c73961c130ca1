"""corewire's developer tooling that is not the product: it lives in the repository and
does not ship in the wheel.

- :mod:`corewire_devtools.chaos`: a data-parallel group serving under injected faults
  (``tools/chaos``, or ``PYTHONPATH=tools python -m corewire_devtools.chaos``).
- :mod:`corewire_devtools.leaks`: the leak probe that run and the test suite share.

It imports the installed ``corewire`` (a wheel, or a development build), never the
source tree's ``python/`` directly.
"""
