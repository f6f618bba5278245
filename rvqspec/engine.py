"""Deprecated alias: the decoding core moved from `rvqspec.engine` to `rvqspec.core` (one meaning per word: the
"engine" is `rvqspec.Engine`, the serving loop; docs/design.md, section 6). `rvqspec.engine` and every
`rvqspec.engine.<module>` still import, as the same module objects as `rvqspec.core.<module>`, with a
DeprecationWarning, for one release (a model pickled before the rename loads too: its classes resolve here)."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

warnings.warn("rvqspec.engine is now rvqspec.core: import from rvqspec.core (the old name goes in the next release)",
              DeprecationWarning, stacklevel=2)

__path__: list[str] = []  # a package, so that `import rvqspec.engine.decode` reaches the finder below


class _CoreAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `rvqspec.engine.<name>` as the module `rvqspec.core.<name>` itself (not a copy: one set of globals)."""

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name.startswith(__name__ + ".") else None

    def create_module(self, spec):
        module = importlib.import_module("rvqspec.core" + spec.name[len(__name__):])
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on the module next
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # already run, as rvqspec.core.<name>: its own spec back


if not any(type(finder).__name__ == "_CoreAlias" for finder in sys.meta_path):  # once, reloaded or not
    sys.meta_path.append(_CoreAlias())  # last: asked only about names no other finder knows
