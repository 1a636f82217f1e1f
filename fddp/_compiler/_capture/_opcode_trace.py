"""The opcode trace of recorded Python: the globals, closure cells and modules it reads, and
its writes to them."""

from __future__ import annotations

import dis
import gc
import sys
import types
from typing import Any, Protocol

from fddp._compiler._capture._saved_state import SavedState
from fddp._compiler._capture._snapshots import MISSING, cell_value, library_frame

# builtins whose result depends on what no read records (a namespace, an object's identity,
# a file) or which act once instead of per call (print, input)
_OPAQUE_BUILTINS = frozenset(
    {
        "globals",
        "locals",
        "vars",
        "eval",
        "exec",
        "compile",
        "__import__",
        "breakpoint",
        "input",
        "open",
        "print",
        "id",
        "hash",
        "repr",
        "setattr",
        "delattr",
    }
)

_LIBRARY_CODE: set[types.CodeType] = set()  # the code of library files met (see library_frame)


def follows_code(trace: Any) -> bool:
    """Whether ``trace`` (``sys.gettrace()``) is an :class:`OpcodeTrace`'s."""
    return getattr(trace, "follows_code", False)


class Unfollowed:
    """Within the block, this thread's :class:`OpcodeTrace` is off: for fddp's and torch's
    work that runs none of the step's Python (an aten op, a block's replay), which a trace
    function would slow (every frame runs unspecialized while one is set)."""

    __slots__ = ("_trace",)

    def __enter__(self) -> None:
        trace = sys.gettrace()
        self._trace = trace if follows_code(trace) else None
        if self._trace is not None:
            sys.settrace(None)

    def __exit__(self, *exc: object) -> None:
        if self._trace is not None:
            sys.settrace(self._trace)


class Record(Protocol):
    """Where the trace notes what it sees (an ``_evidence.Recorder``)."""

    refused: str | None  # why what ran is no evidence
    whole_step: bool  # writes stay and what cannot be checked is left unwatched, not refused
    busy: bool  # the record is at work: the code running now is its own
    writes: list[str]
    saved: SavedState
    functions: dict[types.CodeType, list[types.FunctionType]]  # the functions met, by code

    def read(
        self, owner: Any, kind: str, name: str, value: Any, owner_type: type | None
    ) -> None: ...


class OpcodeTrace:
    """Follows each frame outside torch, fddp and the standard library opcode by opcode
    (``on_call`` is the ``sys.settrace`` function) and notes in ``record`` the globals and
    closure variables the frame loads, the modules it imports, the builtins it calls that read
    what no record sees, and its writes to globals and closure variables (saved to be put back).
    """

    def __init__(self, record: Record) -> None:
        self.record = record
        self._made: set[types.CodeType] = set()  # code nested in code that ran here
        self._instructions: dict[types.CodeType, dict[int, dis.Instruction]] = {}
        self._found: dict[types.CodeType, list[types.FunctionType]] = {}  # found by the gc
        slow = self._on_call

        def on_call(frame: types.FrameType, event: str, arg: Any) -> Any:
            # most calls, while a whole step is traced, are torch's: one test for them
            return None if frame.f_code in _LIBRARY_CODE else slow(frame, event, arg)

        on_call.follows_code = True  # type: ignore[attr-defined]  # see follows_code
        self.on_call = on_call

    def _on_call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "call" or self.record.busy or self.record.refused is not None:
            return None
        code = frame.f_code
        if library_frame(frame):
            if not code.co_filename.startswith("<"):  # generated code counts as its caller's
                _LIBRARY_CODE.add(code)
            return None
        self._made.update(c for c in code.co_consts if isinstance(c, types.CodeType))
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._on_opcode

    def _on_opcode(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        record = self.record
        if event != "opcode" or record.refused is not None:
            return self._on_opcode
        code = frame.f_code
        table = self._instructions.get(code)
        if table is None:
            table = self._instructions[code] = {i.offset: i for i in dis.get_instructions(code)}
        instruction = table.get(frame.f_lasti)
        if instruction is None:
            return self._on_opcode
        op, name = instruction.opname, instruction.argval
        record.busy = True
        try:
            self._handle(frame, op, name, instruction, table)
        finally:
            record.busy = False
        return self._on_opcode

    def _handle(
        self, frame: types.FrameType, op: str, name: Any, instruction: dis.Instruction, table: dict
    ) -> None:
        code = frame.f_code
        if op == "LOAD_GLOBAL":
            self._global(frame, name)
        elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_CLOSURE") and name in code.co_freevars:
            # LOAD_CLOSURE: the cell handed to a closure made here, which reads it unrecorded
            self._cell(frame, name, write=False)
        elif self.record.whole_step:
            return  # a whole step's writes stay; what it cannot check is left unwatched
        elif op in ("STORE_DEREF", "DELETE_DEREF") and name in code.co_freevars:
            self._cell(frame, name, write=True)
        elif op in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            self._global_write(frame, name)
        elif op == "IMPORT_NAME":
            self._import(frame, instruction, table)
        elif op == "LOAD_NAME":
            self.record.refused = f"runs code that looks up {name} by name (a class body, exec)"

    def _global(self, frame: types.FrameType, name: str) -> None:
        namespace = frame.f_globals
        if name not in namespace:
            self.record.read(namespace, "global", name, MISSING, None)
            namespace = frame.f_builtins
        value = namespace.get(name, MISSING)
        opaque = namespace is frame.f_builtins and name in _OPAQUE_BUILTINS
        if opaque and not self.record.whole_step:  # a whole step's side effects are trace-time
            self.record.refused = f"calls {name}()"
            return
        self.record.read(namespace, "global", name, value, None)

    def _cell(self, frame: types.FrameType, name: str, *, write: bool) -> None:
        code = frame.f_code
        if code in self._made:
            return  # a closure made while recording: its cells are the recording's own
        cells = self._cells_of(frame, name)
        if self.record.whole_step and not cells:
            return  # no function alive runs this frame's code with its closure: none to read
        if len(cells) != 1 and not self.record.whole_step:
            self.record.refused = f"reads the closure variable {name} of a function it cannot find"
            return
        if write:
            self.record.writes.append(f"writes the closure variable {name} of {code.co_name}")
            self.record.saved.save_cell(cells[0])
            return
        for cell in cells:  # a whole step's: each function the frame may run, to be sure
            self.record.read(cell, "cell", name, cell_value(cell), None)

    def _cells_of(self, frame: types.FrameType, name: str) -> list[types.CellType]:
        """The cells that may be behind ``frame``'s free variable ``name``: of the functions
        met with this code whose closure holds what the frame holds (for a whole step, of
        those the garbage collector knows, when none was met)."""
        code = frame.f_code
        values = frame.f_locals
        functions = self.record.functions.get(code, ())
        if not functions and self.record.whole_step:
            functions = self._functions_of(code)
        found = [
            f
            for f in functions
            if f.__closure__ is not None
            and all(
                n not in values or cell_value(c) is values[n]
                for n, c in zip(code.co_freevars, f.__closure__)
            )
        ]
        return [dict(zip(code.co_freevars, f.__closure__ or ()))[name] for f in found]

    def _functions_of(self, code: types.CodeType) -> list[types.FunctionType]:
        """Every function of ``code`` alive (once per code: it walks the objects tracked)."""
        found = self._found.get(code)
        if found is None:
            referrers = gc.get_referrers(code)
            found = self._found[code] = [
                f for f in referrers if isinstance(f, types.FunctionType) and f.__code__ is code
            ]
        return found

    def _global_write(self, frame: types.FrameType, name: str) -> None:
        namespace = frame.f_globals
        self.record.writes.append(f"writes the global {name} of {namespace.get('__name__')}")
        self.record.saved.save_item(namespace, name)

    def _import(self, frame: types.FrameType, instruction: dis.Instruction, table: dict) -> None:
        offsets = sorted(o for o in table if o < instruction.offset)
        level = table[offsets[-2]].argval if len(offsets) >= 2 else None
        name = instruction.argval
        if level != 0 or name not in sys.modules:
            self.record.refused = f"imports {name}"
            return
        self.record.read(sys.modules, "global", name, sys.modules[name], None)
