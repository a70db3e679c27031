"""Print one extra's requirements from pyproject.toml, one a line (the image's dependency layer)."""

import sys
import tomllib

with open(sys.argv[1], "rb") as fh:
    project = tomllib.load(fh)["project"]
extras = project.get("optional-dependencies", {})
if sys.argv[2] not in extras:
    sys.exit(f"pyproject.toml has no extra {sys.argv[2]!r}; it has {sorted(extras)}")
print("\n".join([*project.get("dependencies", []), *extras[sys.argv[2]]]))
