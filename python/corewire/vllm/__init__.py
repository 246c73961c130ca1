"""corewire inside vLLM (every release from 0.25.1 to 0.34.0): the ``vllm.general_plugins``
plugin and its adapters.

- :mod:`corewire.vllm.plugin`: the entry point vLLM runs in each of its processes; with
  ``COREWIRE_VLLM_CLIENT=1`` it makes vLLM's ``AsyncLLM`` build corewire's client
  (:mod:`corewire.vllm.self_check`: its check of the installed vLLM).
- :mod:`corewire.vllm.adapters`: the client factory ``AsyncLLM`` calls, the client classes
  it chooses among and the members vLLM's front-end reads, release by release.
- :mod:`corewire.vllm.output`: native output processing inside ``AsyncLLM`` (0.25.1,
  0.33.0, 0.34.0).
- :mod:`corewire.vllm.fast_path`: the per-token path of ``vllm serve`` (0.34.0).
- :mod:`corewire.vllm.serve`: a tiny local model directory and the launcher of a
  ``vllm serve`` stack over corewire engines (the serve script, tests and benchmarks).

Nothing here imports vLLM at package import time: ``import corewire`` never needs vLLM.
Importing any of these modules without vLLM installed raises
:class:`corewire._optional.MissingDependency` (an ``ImportError``) whose message names
``pip install vllm==0.25.1``; it is only looked up here (not imported).
"""

from corewire._optional import require

require("vllm", "corewire.vllm (corewire inside vLLM)")
