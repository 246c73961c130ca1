"""corewire inside vLLM (0.25.1 or 0.33.0): the ``vllm.general_plugins`` plugin and its
adapters.

- :mod:`corewire.vllm.plugin`: the entry point vLLM runs in each of its processes; with
  ``COREWIRE_VLLM_CLIENT=1`` it makes vLLM's ``AsyncLLM`` build corewire's client.
- :mod:`corewire.vllm.client`: corewire's clients with vLLM's constructor arguments and the
  attributes vLLM's front-end reads (0.25.1's; :mod:`corewire.vllm.v0_33_0` adds 0.33.0's
  members, :mod:`corewire.releases` holds each release's launch and ready helpers).
- :mod:`corewire.vllm.model_dir` and :mod:`corewire.vllm.stack`: a tiny local model
  directory and the launcher of a ``vllm serve`` stack over corewire engines (the serve
  script, tests and benchmarks).

Nothing here imports vLLM at package import time: ``import corewire`` never needs vLLM.
Importing any of these modules without vLLM installed raises
:class:`corewire._optional.MissingDependency` (an ``ImportError``) whose message names
``pip install vllm==0.25.1``; it is only looked up here (not imported).
"""

from corewire._optional import require

require("vllm", "corewire.vllm (corewire inside vLLM)")
