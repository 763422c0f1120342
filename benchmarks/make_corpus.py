"""Build the text corpus attnlab ships, ``src/attnlab/assets/shakespeare.tar.xz``, from the full one.

The full corpus (``../shared/data/shakespeare`` beside the checkout: 42 works of Shakespeare, plain text, public
domain, ~5 MB) is 1.58 MB as one xz'd tar, above the 1.5 MB DESIGN.md allows the package. The package holds the
36 plays of the First Folio (1623), every play of the corpus but Pericles, which the Folio left out; the five
poems are left out too (the Sonnets, The Rape of Lucrece, A Lover's Complaint, The Passionate Pilgrim, The Phoenix
and the Turtle). ``WORKS`` below lists the 36. Each is the source file byte for byte, so a test that slices text
from a play gets the same text from either corpus.

The archive is deterministic: members in sorted order, ustar headers with mtime 0, uid and gid 0, no owner names,
mode 0644, compressed by Python's ``lzma`` at preset 9. Beside it, ``shakespeare.sha256`` lists the SHA-256 of every
work (``sha256sum``'s format): ``attnlab.data.shakespeare()`` checks what it extracts against that list.

    python benchmarks/make_corpus.py            # writes the archive and its list of sums
    python benchmarks/make_corpus.py --check    # exit 1 unless both hold exactly the source's works
"""

from __future__ import annotations

import argparse
import hashlib
import io
import lzma
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # locations.py, beside this script
from locations import own_path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "data" / "shakespeare"
ASSETS = ROOT / "src" / "attnlab" / "assets"
ARCHIVE = ASSETS / "shakespeare.tar.xz"
SUMS = ASSETS / "shakespeare.sha256"
LIMIT = 1_500_000  # bytes: DESIGN.md's "at most 1.5 MB"
WORKS = (
    "alls_well_that_ends_well", "antony_and_cleopatra", "as_you_like_it", "comedy_of_errors", "coriolanus",
    "cymbeline", "hamlet", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1", "henry_vi_part_2",
    "henry_vi_part_3", "henry_viii", "john", "julius_caesar", "lear", "loves_labours_lost", "macbeth",
    "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor", "midsummer_nights_dream",
    "much_ado_about_nothing", "othello", "richard_ii", "richard_iii", "romeo_and_juliet", "taming_of_the_shrew",
    "tempest", "timon_of_athens", "tragedy_of_titus_andronicus", "troilus_and_cressida", "twelfth_night",
    "two_gentlemen_of_verona", "winters_tale",
)  # fmt: skip


def read_works(source: Path) -> dict[str, bytes]:
    """``{file name: contents}`` of the shipped works, in sorted order."""
    missing = [w for w in WORKS if not (source / f"{w}.txt").is_file()]
    if missing:
        raise SystemExit(f"make_corpus.py: {source} lacks {', '.join(missing)}")
    return {f"{w}.txt": (source / f"{w}.txt").read_bytes() for w in sorted(WORKS)}


def archive(works: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with (
        lzma.open(buf, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9) as xz,
        tarfile.open(fileobj=xz, mode="w", format=tarfile.USTAR_FORMAT) as tar,
    ):
        for name, data in works.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sums(works: dict[str, bytes]) -> str:
    return "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in works.items())


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="the full corpus (default: %(default)s)")
    parser.add_argument(
        "--check", action="store_true", help="only compare the committed archive and sums with the source"
    )
    args = parser.parse_args()
    if not args.source.is_dir():
        print(f"make_corpus.py: no corpus at {args.source}; pass --source DIR", file=sys.stderr)
        return 2
    works = read_works(args.source)
    if args.check:
        # The works, not the archive's bytes: another liblzma may compress the same tar differently.
        same = members(ARCHIVE.read_bytes()) == works and SUMS.read_text() == sums(works)
        print(f"{ARCHIVE.relative_to(ROOT)}: {'matches' if same else 'DIFFERS FROM'} {args.source}")
        return 0 if same else 1
    data = archive(works)
    if len(data) > LIMIT:
        raise SystemExit(f"make_corpus.py: the archive is {len(data)} bytes, above the package's {LIMIT}")
    from attnlab.atomic import write_atomic

    write_atomic(ARCHIVE, data, sources=[args.source], ours=own_path(ARCHIVE))
    write_atomic(SUMS, sums(works), sources=[args.source], ours=own_path(SUMS))
    size = sum(map(len, works.values()))
    print(f"wrote {ARCHIVE.relative_to(ROOT)}: {len(works)} works, {size} bytes of text, {len(data)} packed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
