"""Reading tally's log lines in the bench scripts: timestamps and `key=value` fields."""
import re
from datetime import datetime


def ts(line):
    """The timestamp a log line starts with."""
    return datetime.fromisoformat(line.split()[0].replace("Z", "+00:00"))


def stamp(path):
    """A timestamp the bench wrote to a file (`date -u +%Y-%m-%dT%H:%M:%S.%6NZ`)."""
    return datetime.fromisoformat(open(path).read().strip().replace("Z", "+00:00"))


def field(line, key):
    """The value of ` key=` in a log line, or "?"."""
    found = re.search(rf" {key}=(\S+)", line)
    return found[1] if found else "?"
