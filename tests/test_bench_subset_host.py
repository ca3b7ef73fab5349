"""bench/subset_host.py: the host cost of checking and converting one PARSE subset, on a small preset."""

import json

from rankserve.bench import subset_host
from rankserve.workers.parse import validate
from rankserve.workers.parse_batching import subset_ids


def test_subset_host_times_a_valid_subset_and_writes_json(tmp_path):
    out = tmp_path / "host.json"
    res = subset_host.main(["--out", str(out), "--shape", "tiny", "--repeats", "2"])
    assert json.loads(out.read_text()) == res
    routers = subset_host.routers_of("tiny", 0.6)
    assert res["indices"] == sum(routers.k.values()) and res["matrices"] == len(routers.k)
    assert res["validate_ms"] >= 0 and res["subset_ids_ms"] >= 0
    assert all(routers.k[n] < routers.r_max[n] for n in routers.k)  # a pool to choose from
    s = subset_host.overlapping_subsets(routers, 2, 1.05, 0)[0]  # what it times is a valid subset
    assert validate(s, routers) == s and len(subset_ids(s, routers)) == res["indices"]
