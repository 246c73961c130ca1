"""corewire inside vLLM (every release from 0.25.1 to 0.34.0): the ``vllm.general_plugins``
plugin and its adapters.

- :mod:`corewire.vllm.plugin`: the entry point vLLM runs in each of its processes; with
  ``COREWIRE_VLLM_CLIENT=1`` it makes vLLM's ``AsyncLLM`` build corewire's client.
- :mod:`corewire.vllm.classes`: the client factory ``AsyncLLM`` calls and the client
  classes it chooses among; :mod:`corewire.vllm.client`: what they share, vLLM's
  constructor arguments and the attributes vLLM's front-end reads (0.25.1's;
  :mod:`corewire.vllm.v0_33_0` and :mod:`corewire.vllm.v0_34_0` add later releases'
  members, :mod:`corewire.vllm.frontend` holds each release's launch and ready helpers).
- :mod:`corewire.vllm.output` (and its per-release modules, chosen by
  :mod:`corewire.vllm.output_processors`): native output processing inside ``AsyncLLM``
  (0.25.1, 0.33.0, 0.34.0); :mod:`corewire.vllm.fast_path`: the
  per-token path of ``vllm serve`` (0.34.0); :mod:`corewire.vllm.multimodal`: requests with
  images, through vLLM's own encoder.
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
