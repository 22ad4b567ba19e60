"""What `flwr run` ships to the SuperNodes: the package, without the operator-side harness."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

from flwr.cli.build import build_fab_from_disk

ROOT = Path(__file__).resolve().parents[1]


def test_app_bundle_holds_the_apps_and_not_the_harness():
    # Execute: the bundle Flower builds from this folder
    names = set(zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist())
    # Assert: both apps and what they import are in; command line, launcher, demo, harness,
    # examples out
    assert {"fedcybgd/server/app.py", "fedcybgd/client/app.py",
            "fedcybgd/strategies/fedcybgd.py"} <= names
    assert {"fedcybgd/model/blocks.py", "fedcybgd/model/layerwise.py",
            "fedcybgd/memory/estimate.py", "fedcybgd/protocol/zeroth_order.py"} <= names
    assert not any(n.startswith(("fedcybgd/deploy/", "fedcybgd/harness/", "fedcybgd/cli/"))
                   for n in names)
    assert "fedcybgd/cli/demo.py" not in names
    assert not any(n.startswith(("experiments/", "tests/", "outputs/", "examples/"))
                   for n in names)
