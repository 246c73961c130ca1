"""What every vLLM release corewire speaks is: :class:`Release`, a version string whose
attributes say what that release's engines and front-end do (vLLM 0.25.1's values here), and
the facts of its wire read off its record.

A release is data: nothing here imports another layer of corewire. The code that differs
between releases lives in the layer that runs it, which picks its own entry for a release
with :meth:`Release.choose` (the engine's utilities in ``corewire.engine.utilities``, the
request writers in ``corewire.wire.requests``, vLLM's front-end helpers in
``corewire.vllm.adapters.frontend``, the client members in
``corewire.vllm.adapters.classes``, the output processors in
``corewire.vllm.output.by_release``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from corewire.releases import records

__all__ = ["Release", "registered"]

_Entry = TypeVar("_Entry")

#: Every release class by the release it was written for (its ``NAME``), filled as each
#: is defined: what :meth:`Release.choose` accepts as a key.
_CLASSES_BY_NAME: dict[str, type[Release]] = {}
#: The one instance of each release, by version (filled by ``corewire.releases``).
_INSTANCES: dict[str, Release] = {}
#: Each release's facts read off its record, by ``(release, fact)``: read once, since
#: some are asked per message (a record is parsed afresh by every ``records.load``).
_FACTS: dict[tuple[str, str], Any] = {}


def registered(name: str) -> Release:
    """The registered instance of release ``name`` (how a pickled release comes back)."""
    return _INSTANCES[name]


class Release(str):
    """One vLLM release: its engine-core wire and what its engines and front-end do
    beyond the wire's struct layouts.

    A release *is* its version string (``"0.33.0"``: a ``str`` subclass), because that is
    how the wire itself names it (the ready response's ``vllm_version``) and how callers
    choose one (``release="0.33.0"``); everything else about it is an attribute. Code
    outside :mod:`corewire.releases` reads those attributes and never compares version
    strings: a further release is one more class here (or none at all, when only its
    struct layouts changed) and, where a layer's code differs for it, one more entry in
    that layer's table (:meth:`choose`), not a hunt through ``if`` statements.

    Each class stands for the release it names and, as registered in
    :mod:`corewire.releases`, for the releases after it until the next class; there is
    one instance per release (:func:`corewire.releases.get`).
    """

    __slots__ = ()

    #: The release this class was written for (an instance may name a later one that
    #: behaves the same).
    NAME: ClassVar[str]

    # -- behaviour (docs/protocol.md §11); vLLM 0.25.1's values here --------------------

    #: DP counts are ``[waiting, running, kv_cache_usage]`` (else ``[waiting, running]``),
    #: and engines report the KV cache's use to the coordinator.
    counts_carry_kv_usage: ClassVar[bool] = False
    #: Front-ends send no first-request notices: an idle engine that takes a request
    #: starts the wave itself (else the front-end's notice starts it).
    engine_led_waves: ClassVar[bool] = False
    #: Engines answer ``pause_generation`` (refusing new work with ``RequestError``),
    #: weight versions, ``release_kv_cache_memory``, ``compute_weight_checksums``.
    generation_pause_utilities: ClassVar[bool] = False
    #: Internal load balancing adds the KV-pressure term to an engine's waiting count.
    kv_pressure_routing: ClassVar[bool] = False
    #: Internal load balancing keeps a streaming-input session on its engine and aborts
    #: an open session on every engine.
    session_affinity: ClassVar[bool] = False
    #: ``SamplingParams`` drops repeated ``stop_token_ids`` and ``bad_words`` when built,
    #: so a front-end writes each once (0.28.0 on).
    drops_repeated_stops: ClassVar[bool] = False
    #: Front-ends call the process-checkpoint utilities (``checkpoint_prepare`` /
    #: ``_restore`` / ``_state``), pass ``reset_connector`` to ``sleep`` and
    #: ``release_kv_cache_memory``, and read the managed engine's status map as the
    #: client's ``engine_status``.
    process_checkpoints: ClassVar[bool] = False
    #: The OpenAI server's streamed chat, with running usage, gives the role chunk's usage
    #: the prompt's token details (known from the first output, as the final usage's).
    chat_role_usage_details: ClassVar[bool] = False
    #: corewire's native output processing (``corewire.vllm.output.processor``) is held to the
    #: ``OutputProcessor`` of the release this class was written for by the differential
    #: tests (read through :attr:`native_output`).
    NATIVE_OUTPUT: ClassVar[bool] = False
    #: The per-token fast path of ``vllm serve`` (``corewire.vllm.fast_path``) is held to
    #: the OpenAI server of the release this class was written for by the differential HTTP
    #: tests (read through :attr:`fast_path`; installed by ``corewire.vllm.fast_path``).
    FAST_PATH: ClassVar[bool] = False
    #: corewire's client inside vLLM (``corewire.vllm``) is built for the ``AsyncLLM`` of
    #: the release this class was written for: ``corewire.vllm.adapters.classes`` (read through
    #: :attr:`vllm_client`, for the releases in :attr:`LIVE_CHECKED`).
    VLLM_CLIENT: ClassVar[bool] = False
    #: The releases this class stands for that were checked live against it: the plugin
    #: under that release's ``AsyncLLM`` and API server, and corewire engines behind that
    #: release's own client (the live modules of ``scripts/test``, run in a venv with that
    #: release). Each class names its own; a release it stands for that is not listed has
    #: only its wire checked (its record's golden frames) and is not :attr:`verified`.
    LIVE_CHECKED: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, name: str | None = None) -> Release:
        # ``name``: a later release this class describes (see the class docstring).
        return super().__new__(cls, cls.NAME if name is None else name)

    def __repr__(self) -> str:
        # As the version string it is: messages and logs that show a protocol with !r
        # read as they always did.
        return repr(str.__str__(self))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Only a class written for a release of its own is a key of the layers' tables.
        name = cls.__dict__.get("NAME")
        if name is not None:
            _CLASSES_BY_NAME[name] = cls

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (multiprocessing's spawn arguments) as the registered instance.
        return (registered, (str.__str__(self),))

    @property
    def name(self) -> str:
        """The version string, as a plain ``str``."""
        return str.__str__(self)

    @property
    def verified(self) -> bool:
        """Whether this release's behaviour was checked against the release itself (its
        class's :attr:`LIVE_CHECKED` names it); else it behaves as the release its class
        was written for, unchecked, and only its wire (recorded from the release) is known
        to be its own."""
        return self.name in self.LIVE_CHECKED

    @property
    def written_for(self) -> bool:
        """Whether this release is the one its class was written for (not a later one
        it stands for): what is held to one release's own code, such as native output
        processing or a request converter into that release's layout, applies only there."""
        return self.name == self.NAME

    @property
    def native_output(self) -> bool:
        """Whether the plugin may install native output processing under this release:
        only where it was checked against this very release's ``OutputProcessor``."""
        return self.written_for and self.verified and self.NATIVE_OUTPUT

    @property
    def fast_path(self) -> bool:
        """Whether the plugin may install ``vllm serve``'s fast path under this release:
        only where it was checked against this very release's OpenAI server, with native
        output processing (which it writes from)."""
        return self.native_output and self.FAST_PATH

    @property
    def vllm_client(self) -> bool:
        """Whether the plugin may put corewire's client inside this release's
        ``AsyncLLM``: only where its client classes were written and tested for this very
        release (a release only recorded may have moved the front-end code they call)."""
        return self.verified and self.VLLM_CLIENT

    def choose(self, table: Mapping[str, _Entry]) -> _Entry:
        """The entry of ``table`` that stands for this release.

        ``table`` is a layer's own per-release code, keyed by the release each entry was
        written for (the ``NAME`` of a release class, oldest first or in any order): the
        entry of the nearest class in this release's lineage wins, so a release whose
        class has no entry behaves as the one before it. This is how a layer keeps what
        differs between releases without comparing version strings. A key that names no
        release class is refused (a typo would otherwise never be chosen).
        """
        unknown = [key for key in table if key not in _CLASSES_BY_NAME]
        if unknown:
            raise ValueError(
                f"no release class is written for {unknown}: {sorted(_CLASSES_BY_NAME)}"
            )
        for cls in type(self).__mro__:
            name = cls.__dict__.get("NAME")
            if name is not None and name in table:
                return table[name]
        raise LookupError(f"no entry stands for vLLM {self.name} (entries: {list(table)})")

    # -- facts of the wire, read off the release's record -----------------------------

    @property
    def record(self) -> dict[str, Any]:
        """This release's recorded wire: every struct's layout (``corewire.releases.records``)."""
        return records.load(self.name)

    @property
    def request_errors(self) -> bool:
        """``EngineCoreOutput`` has an ``error`` field (a ``RequestError``) that an
        engine's refusals carry; before it, the reason travels in ``stop_reason``."""
        return "error" in self._fields("EngineCoreOutput")

    @property
    def weight_versions(self) -> bool:
        """Every message a step produces carries the engine's ``weight_version``."""
        return "weight_version" in self._fields("EngineCoreOutputs")

    @property
    def packs_prompts(self) -> bool:
        """``EngineCoreRequest.prompt_token_ids`` is an ndarray on the wire (0.34.0 on:
        its front-end packs each prompt as int32, inline below 256 bytes, an aux frame
        above), else a list of ints."""
        return self._fact("packs_prompts", self._packs_prompts)

    def _packs_prompts(self) -> bool:
        entry = self.record["structs"]["EngineCoreRequest"]
        field = next(f for f in entry["fields"] if f["name"] == "prompt_token_ids")
        kind = field["type"]
        options = kind["types"] if kind.get("kind") == "union" else [kind]
        return any(option.get("class") == "numpy.ndarray" for option in options)

    @property
    def speaks_protocol_structs(self) -> bool:
        """Whether this release's wire is the one ``corewire.protocol``'s structs lay out
        (vLLM 0.25.1's, what engines build and clients are given): then nothing is
        converted on either side. Read off the records: ``EngineCoreOutputs`` and every
        struct and enum it reaches laid out as in 0.25.1's."""
        return self._fact("speaks_protocol_structs", self._speaks_protocol_structs)

    def _speaks_protocol_structs(self) -> bool:
        base = records.load(_BASE_RELEASE)
        name = "EngineCoreOutputs"
        return records.reachable(self.record, name) == records.reachable(base, name)

    #: The structs whose positions the native decoder reads (``NativeDecoder(layout=)``).
    NATIVE_STRUCTS: ClassVar[tuple[str, ...]] = (
        "EngineCoreOutputs",
        "EngineCoreOutput",
        "UtilityOutput",
        "LogprobsLists",
        "LogprobsTensors",
        "SamplingMaskLists",
    )

    @property
    def native_layout(self) -> dict[str, tuple[str, ...]]:
        """Where this release puts each field the native decoder reads: each struct's
        wire names in wire order, read off its record, so that the decoder follows the
        release rather than a table of its own."""
        return dict(self._fact("native_layout", self._native_layout))

    def _native_layout(self) -> dict[str, tuple[str, ...]]:
        structs = self.record["structs"]
        return {name: self._fields(name) for name in self.NATIVE_STRUCTS if name in structs}

    def _fields(self, name: str) -> tuple[str, ...]:
        return self._fact(f"fields:{name}", lambda: self._read_fields(name))

    def _read_fields(self, name: str) -> tuple[str, ...]:
        entry = self.record["structs"].get(name)
        return () if entry is None else tuple(f["encode_name"] for f in entry["fields"])

    def _fact(self, key: str, read: Callable[[], _Entry]) -> _Entry:
        # Read once per release: the facts of a record never change in a process.
        try:
            return _FACTS[self.name, key]
        except KeyError:
            value = _FACTS[self.name, key] = read()
            return value


#: The release whose wire ``corewire.protocol`` lays out.
_BASE_RELEASE = "0.25.1"
