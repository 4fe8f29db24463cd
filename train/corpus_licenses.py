"""Which licences the broad corpus accepts, read from a Python distribution's metadata.

A distribution is kept only when every licence signal it gives is permissive: its SPDX
`License-Expression` when present (an `OR` needs one permissive choice, an `AND` needs all), else its
`License` field (when it is a short name, not a pasted licence text) together with its
`License ::` classifiers. No signal, an unknown name, or any copyleft / proprietary signal: left out.
"""

from __future__ import annotations

import re
from pathlib import Path

# SPDX ids (lower case) and the free-text names packages write in `License:` / classifiers.
PERMISSIVE_SPDX = {
    "mit",
    "mit-0",
    "mit-cmu",
    "x11",
    "bsd-2-clause",
    "bsd-3-clause",
    "bsd-3-clause-clear",
    "0bsd",
    "apache-2.0",
    "psf-2.0",
    "python-2.0",
    "cnri-python",
    "isc",
    "zlib",
    "unlicense",
    "cc0-1.0",
    "hpnd",
    "bsl-1.0",
    "afl-2.1",
    "ncsa",
    "upl-1.0",
}
PERMISSIVE_NAMES = {
    "mit",
    "mit license",
    "the mit license",
    "mit no attribution license",
    "bsd",
    "bsd license",
    "new bsd",
    "new bsd license",
    "modified bsd",
    "simplified bsd",
    "3-clause bsd",
    "3-clause bsd license",
    "bsd 3-clause",
    "bsd-3",
    "2-clause bsd",
    "apache",
    "apache 2",
    "apache 2.0",
    "apache-2",
    "apache license",
    "apache license 2.0",
    "apache license, version 2.0",
    "apache 2.0 license",
    "apache software license",
    "apache software license 2.0",
    "isc",
    "isc license",
    "isc license (iscl)",
    "psf",
    "psfl",
    "python software foundation license",
    "zlib",
    "zlib/libpng license",
    "the unlicense (unlicense)",
    "public domain",
}
# Words that make any signal non-permissive (weak copyleft such as MPL included: files of it may not
# be mixed freely into a training set published under another licence).
COPYLEFT_MARKERS = ("gpl", "general public", "mpl", "mozilla public", "cc-by-sa", "sharealike", "proprietary", "eupl")
MAX_NAME_CHARS = 60  # a longer `License:` field is a pasted licence text, not a name


def spdx_permissive(expression: str) -> bool:
    """An SPDX expression: permissive when some OR-alternative has only permissive ids."""
    text = expression.strip().lower().replace("(", " ").replace(")", " ")
    if not text:
        return False
    for alternative in re.split(r"\s+or\s+", text):
        ids = [i.split(" with ")[0].strip() for i in re.split(r"\s+and\s+", alternative)]
        if ids and all(i.removeprefix("licenseref-") in PERMISSIVE_SPDX for i in ids):
            return True
    return False


def name_permissive(name: str) -> bool | None:
    """True / False for a known licence name, None for one this module does not know."""
    low = " ".join(name.lower().split())
    if any(m in low for m in COPYLEFT_MARKERS):
        return False
    if low in PERMISSIVE_NAMES or spdx_permissive(low):
        return True
    return None


def distribution_license(metadata) -> tuple[str | None, str]:
    """(licence label, reason) of a distribution's metadata (an email.message-like mapping);
    the label is None when the distribution is left out, the reason says why or what was read."""
    expression = (metadata.get("License-Expression") or "").strip()
    if expression:
        ok = spdx_permissive(expression)
        return (expression if ok else None), f"License-Expression {expression!r}"
    signals: list[tuple[str, bool | None]] = []
    field = (metadata.get("License") or "").strip()
    if field and field.upper() != "UNKNOWN":
        if len(field) <= MAX_NAME_CHARS and "\n" not in field:
            signals.append((field, name_permissive(field)))
        elif any(m in field.lower() for m in ("gnu general public", "lesser general public")):
            signals.append(("GPL licence text", False))
    for classifier in metadata.get_all("Classifier") or []:
        parts = [p.strip() for p in classifier.split("::")]
        if parts[0] == "License" and len(parts) > 1:
            name = parts[-1]
            if name == "OSI Approved":  # the bare category says nothing about which licence
                continue
            signals.append((name, name_permissive(name)))
    if not signals:
        return None, "no licence in the metadata"
    bad = [name for name, ok in signals if ok is not True]
    if bad:
        return None, f"not known to be permissive: {bad[0]!r}"
    names = list(dict.fromkeys(name for name, _ in signals))
    return " / ".join(names), "License / classifiers"


def debian_copyright_licenses(package: str, doc_root: Path = Path("/usr/share/doc")) -> list[str] | None:
    """The distinct `License:` names of a Debian package's copyright file (None: not installed)."""
    path = doc_root / package / "copyright"
    if not path.is_file():
        return None
    names = re.findall(r"^License:[ \t]*(\S[^\n]*)$", path.read_text(encoding="utf-8", errors="replace"), re.M)
    return sorted({" ".join(n.split()) for n in names})
