"""How a setting is declared (`setting(...)` on a field of a section class, `afd.config.sections`) and what
derives from a declaration (`Setting`: its variable, flag, allowed values and check); the allowed values of
the choice settings. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, get_args, get_origin, get_type_hints

# The allowed values of the settings that name a choice; the tuples are what other modules check against.
Role = Literal["attention", "ffn", "monolithic"]  # monolithic: one process, the FFN local (afd.roles.monolithic)
Connector = Literal["loopback", "zmq", "nccl"]
StageCount = Literal[1, 2]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp8"]  # afd.models.kv_dtype: auto = the model's dtype, fp8 = float8 e4m3
Device = Literal["auto", "cpu", "cuda"]
AttentionEngine = Literal["afd", "vllm"]  # vllm: the attention pod runs vLLM with afd.vllm_plugin
ROLES: tuple[str, ...] = get_args(Role)
CONNECTORS: tuple[str, ...] = get_args(Connector)
STAGES: tuple[int, ...] = get_args(StageCount)
DTYPES: tuple[str, ...] = get_args(Dtype)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
DEVICES: tuple[str, ...] = get_args(Device)
ATTENTION_ENGINES: tuple[str, ...] = get_args(AttentionEngine)
MAX_EXPERT_PARALLEL = 64
MAX_API_SERVERS = 16  # API processes of one rank

A, F, M = ROLES  # the roles that read a setting (`roles=`)


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names it."""


def setting(default: Any, help: str, *, roles: tuple[str, ...] = ROLES, ge: float | None = None,
            gt: float | None = None, le: float | None = None, check: Callable[[Any], str | None] | None = None,
            flag: bool | None = None, secret: bool = False) -> Any:
    """Declare one setting, a field of its section's class (its section), and everything derived from it. Its
    variable is `AFD_` + the name in capitals and its flag `--the-name`; `help` is its line in docs/configuration.md
    and `afd serve --help`; `ge`/`gt`/`le` bound a number (every number needs one: a test); a `Literal` type lists
    the allowed values; `check` says what is wrong with a value, or None; `roles` read it; `flag=False`: no
    `afd serve` flag (the rank counts: `--topology` sets them); `secret`: not in repr, errors or docs, no default
    shown, and no flag unless `flag=True` says so (a value on a command line shows in `ps`)."""
    metadata = {"help": help, "roles": roles, "ge": ge, "gt": gt, "le": le, "check": check,
                "flag": (not secret) if flag is None else flag, "secret": secret}
    return field(default=default, repr=not secret, metadata=metadata)


def section(title: str) -> Any:
    """Declare one section of `AFDConfig` (a field whose type is the section's class; its name is the section's);
    `title` heads its settings in docs/configuration.md and `afd serve --help`."""
    return field(metadata={"title": title})


@dataclass(frozen=True)
class Setting:
    """One setting as its field declares it, with what derives from its name and type."""

    name: str
    type: type  # bool, int, float or str: what a variable's text is parsed as
    default: Any
    help: str
    section: str  # the `AFDConfig` section holding it (`afd.config.SECTIONS`)
    roles: tuple[str, ...]
    choices: tuple = ()  # from a Literal type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    check_value: Callable[[Any], str | None] | None = None
    flag: bool = True
    secret: bool = False

    @property
    def env(self) -> str:
        return "AFD_" + self.name.upper()

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def bounded(self) -> bool:
        return bool(self.choices) or any(bound is not None for bound in (self.ge, self.gt, self.le))

    @property
    def allowed(self) -> str:
        """The allowed values in words ('' where any value of the type is)."""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        if self.le is not None:
            low = f"({self.gt:g}, " if self.gt is not None else f"{self.ge:g}.." if self.ge is not None else "up to "
            return f"in {low}{self.le:g}{']' if self.gt is not None else ''}"
        if self.gt == 0:
            return "positive"
        if self.ge == 0:
            return "not negative"
        if self.ge is not None or self.gt is not None:
            return f"at least {self.ge:g}" if self.ge is not None else f"above {self.gt:g}"
        return (self.check_value.__doc__ or "") if self.check_value else ""  # a check's docstring says what it takes

    def check(self, value: Any) -> None:
        """Refuse a value outside the declared choices, bounds or format, naming the setting and the value."""
        if self.choices and value not in self.choices:
            raise ConfigError(f"{self.name}={value!r}: must be {self.allowed}")
        low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        if not (low_ok and (self.le is None or value <= self.le)):
            raise ConfigError(f"{self.name}={value}: must " + ("not be negative" if self.ge == 0 and self.le is None
                                                               else f"be {self.allowed}"))
        problem = self.check_value(value) if self.check_value else None
        if problem:
            raise ConfigError(f"{self.name}={'(secret)' if self.secret else repr(value)}: {problem}")


def settings_of(cls: type, section: str) -> dict[str, Setting]:
    """The declarations of the fields of `cls`, the class of section `section`; a field declared without
    `setting(...)`, or a number without a bound, is refused here, at import, before any process can run with an
    unchecked setting."""
    hints = get_type_hints(cls)
    table = {}
    for f in fields(cls):
        meta, hint = f.metadata, hints[f.name]
        if "help" not in meta:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with setting(default, help, ...)")
        choices = get_args(hint) if get_origin(hint) is Literal else ()
        table[f.name] = spec = Setting(
            name=f.name, type=type(choices[0]) if choices else hint, default=f.default, help=meta["help"],
            section=section, roles=meta["roles"], choices=choices, ge=meta["ge"], gt=meta["gt"], le=meta["le"],
            check_value=meta["check"], flag=meta["flag"], secret=meta["secret"])
        if spec.type not in (bool, int, float, str):
            raise TypeError(f"{cls.__name__}.{f.name}: a bool, int, float, str or Literal")
        if spec.type in (int, float) and not spec.bounded:
            raise TypeError(f"{cls.__name__}.{f.name}: a number needs bounds (ge=, gt= or le=) or a Literal type")
    return table


def parse_bool(text: str) -> bool:
    """`true`/`false` as a variable or flag spells it (1/0, yes/no, on/off; empty: false)."""
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


# A setting's type → what parses its text (a variable, a flag, a file's value).
PARSERS: dict[type, Callable[[Any], Any]] = {int: int, float: float, bool: parse_bool, str: str}
