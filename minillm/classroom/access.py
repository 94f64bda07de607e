"""Who may read what: the paths the student's user needs (the interpreter, its packages, the graded folder) and
the paths it must not reach, checked on the permission bits of every folder on the way."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from .regions import ExerciseError


def user_ids(user: str) -> tuple[int, int]:
    import pwd
    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def unreadable_for(user: str, paths: list[str]) -> list[str]:
    """The paths in `paths` (or folders above them) that `user` cannot read or pass through."""
    uid, gid = user_ids(user)

    def allowed(st: os.stat_result, want: int) -> bool:
        if st.st_uid == uid:
            bits = st.st_mode >> 6
        elif st.st_gid == gid:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        return bits & want == want

    bad = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            continue
        chain = [*reversed(p.parents), p]
        for i, part in enumerate(chain):
            st = part.stat()
            last = i == len(chain) - 1
            want = (5 if stat.S_ISDIR(st.st_mode) else 4) if last else 1
            if not allowed(st, want):
                bad.append(f"{part} (needed for {path})" if part != p else str(p))
                break
    return bad


def child_sys_path() -> list[str]:
    """The folders the children's interpreter (`python -I`, as the starter runs) imports from: its standard
    library and installed packages, what .pth files add, and nothing of the grader's own sys.path."""
    probe = subprocess.run([sys.executable, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
                           capture_output=True, text=True, cwd="/", timeout=120)
    if probe.returncode != 0:
        raise ExerciseError(f"{sys.executable} -I could not start ({probe.stderr.strip()[-300:]}), so the children "
                            f"could not either; grade with an interpreter that starts")
    return [p for p in json.loads(probe.stdout) if p and os.path.isabs(p) and not p.endswith(".zip")]


def check_user_can_run(user: str, folder: Path) -> None:
    """Refuse before grading when `user` cannot read the interpreter, its standard library, a folder the
    children's interpreter imports from, or the graded folder: otherwise an honest solution would fail on an
    import. The grader's own sys.path is not the children's: the checks' folder is on it, and private."""
    import sysconfig
    paths = [os.path.realpath(sys.executable), sys.executable, sysconfig.get_paths()["stdlib"], str(folder),
             str(folder / "minillm" / "classroom" / "child.py"), *child_sys_path()]
    bad = unreadable_for(user, paths)
    if bad:
        raise ExerciseError(f"--user {user} cannot read what the student's code needs to run: {', '.join(bad[:4])}"
                            f"{' ...' if len(bad) > 4 else ''}; install Python and the packages where {user} can "
                            f"read them, not under a folder of mode 700 such as a private home or a mktemp -d "
                            f"folder (on Gradescope's image: the system Python, and setup.sh's pip install into it)")
