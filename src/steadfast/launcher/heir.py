"""The node's worker template and its heir: what the template imports for the workers
it forks is only added by a new template, never by the one that serves.

Inductor's compiler (:data:`steadfast.seam.COMPILER`) is worth preloading once a worker
of the job compiled: each restart's workers then start without importing it (~2 s on 2
cores). Imported by the serving template, it held up any restart whose fault came in
those seconds (a worker asked for waits until the import ends: a fork while importing is
not safe), and a fault can come at any moment. So a second template, the *heir*, starts
with the compiler in its preloads, while the first one goes on serving; the first
generation of workers started after the heir is ready is forked from it, and the old
template is closed (its workers have all ended by then). Its price: a second import of
torch beside the training, once per node of a job that compiles.
"""

from __future__ import annotations

import logging

from .template import Template

__all__ = ["Templates"]

logger = logging.getLogger(__name__)


class Templates:
    """The template that serves each generation (:meth:`for_generation`), and the heir
    that takes over from it once ready (:meth:`want`)."""

    def __init__(self, template: Template | None) -> None:
        self.current = template
        self._heir: Template | None = None
        self._wanted: set[str] = set()

    def want(self, name: str) -> None:
        """The workers should find ``name`` imported: start an heir that imports it
        (with what the serving template has), unless one has it already. Returns at once."""
        if self.current is None or name in self._wanted:
            return
        self._wanted.add(name)
        if self._heir is not None:  # a newer wish: an heir of its own, with both
            self._heir.close()
        preloads = tuple(dict.fromkeys([*self.current.preloads, *sorted(self._wanted)]))
        self._heir = Template(env=self.current.env, preload=preloads)

    def for_generation(self) -> Template | None:
        """The template to fork the next generation's workers from (called once the last
        generation's workers have all ended): the heir if it is ready (the old template
        is closed then), else the one that served so far; never waits."""
        heir = self._heir
        if heir is None or self.current is None:
            return self.current
        if heir.ready(0):
            old, self.current, self._heir = self.current, heir, None
            old.close()
        elif heir.gone():  # its import failed: the workers import what they need
            logger.warning("the worker template's heir ended before it was ready")
            self._heir = None
            heir.close()
        return self.current

    def close(self) -> None:
        """Close the heir (maybe still importing) and the serving template."""
        for template in (self._heir, self.current):
            if template is not None:
                template.close()
        self._heir = None
