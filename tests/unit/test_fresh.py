"""The generators a forked worker inherits from the template: every one a new
interpreter would have seeded from the OS is drawn again (steadfast.launcher.fresh)."""

from __future__ import annotations

import json
import subprocess
import sys

from steadfast.launcher.fresh import RESEEDED

CENSUS = """
import gc, importlib, json, random, sys, warnings
warnings.simplefilter("ignore")
from steadfast import seam
for name in ("torch", "torch.distributed", "torch.nn.parallel", *seam.PRELOADED):
    seam.preload(name) if name in seam.PRELOADED else importlib.import_module(name)
import numpy.random, torch
kinds = (random.Random, numpy.random.RandomState, numpy.random.Generator,
         numpy.random.BitGenerator, torch.Generator)
def seeded_by_os(obj):
    return isinstance(obj, kinds) and not isinstance(obj, random.SystemRandom)
from steadfast.launcher.fresh import held_generators
handled = {id(generator) for _, generator in held_generators()}
named, seen = set(), set()
for modname, module in list(sys.modules.items()):
    for attr, value in list(vars(module).items()) if module is not None else ():
        if seeded_by_os(value) and value is not random._inst:
            seen.add(id(value))
            if id(value) not in handled:
                named.add(f"{modname}:{attr}")
        if isinstance(value, type) and getattr(value, "__module__", None) == modname:
            for cattr, cvalue in list(vars(value).items()):
                if seeded_by_os(cvalue):
                    seen.add(id(cvalue))
                    if id(cvalue) not in handled:
                        named.add(f"{modname}:{value.__name__}.{cattr}")
hidden = [type(o).__name__ for o in gc.get_objects()
          if isinstance(o, random.Random) and not isinstance(o, random.SystemRandom)
          and o is not random._inst and id(o) not in seen]
print(json.dumps({"unhandled": sorted(named), "hidden": hidden, "handled": len(handled)}))
"""


def test_every_generator_the_template_holds_is_drawn_again_in_its_workers():
    """A census of the template's modules after its imports and preloads: every generator
    of Python's random, numpy or torch held by a module or a class (under any of its
    names) is one that fresh_random_streams draws again (a torch that preloads a new one
    fails here, naming it), and no Random hides elsewhere."""
    done = subprocess.run(
        [sys.executable, "-c", CENSUS],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    census = json.loads(done.stdout.strip().splitlines()[-1])
    assert census["unhandled"] == [], "generators forked workers would share"
    assert census["hidden"] == []
    assert census["handled"] == len(RESEEDED)  # each name still names a generator
