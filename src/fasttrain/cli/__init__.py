"""Command line: parse, call the library, render (``fasttrain --help`` says what each command
does and how it ends). One module a concept:

- ``parser``: ``build_parser`` and each command's options;
- ``dispatch``: ``main``, the one place a mistake, a failed run, Ctrl-C or SIGTERM becomes one
  line and an exit status;
- ``common``: what the commands share (--out files, --device, the base recipe, the checks);
- one module a command family: ``ladder`` (and ``--long``), ``train``, ``profile``, ``fit``,
  ``scaling``, ``infer``, and ``report`` (report, docs, presets, workloads).

torch and the library's floors are imported inside the functions that use them, not when this
package is imported."""
from __future__ import annotations

from .dispatch import main
from .parser import build_parser

__all__ = ["build_parser", "main"]
