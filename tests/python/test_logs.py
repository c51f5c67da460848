# SPDX-License-Identifier: Apache-2.0
"""The daemons' logs: every line carries a UTC timestamp to the microsecond,
the level, the node's name and rank and the source line (text), or is one
JSON object (--log_format=json); --log_level drops what is below it. Before
the logger, lines were bare "microd: ..." with no time, level or rank."""
import json
import re

TEXT = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6} (DEBUG|INFO|WARNING|ERROR) "
                  r"(\S+)/(\d+|-) [\w.]+:\d+\] (.*)$")


def lines(cluster, r):
    return [x for x in cluster.daemon_log(r).splitlines() if x.strip()]


def test_text_lines_name_time_level_node_and_rank(make_cluster):
    c = make_cluster(2, 1, ["--sparsifier=micro"])
    for r in range(2):
        log = lines(c, r)
        assert log, f"node {r} logged nothing"
        parsed = [TEXT.match(x) for x in log]
        assert all(parsed), [x for x, m in zip(log, parsed) if not m]
        assert {m.group(2) for m in parsed} == {f"node{r}"}
        joined = [m for m in parsed if "is rank" in m.group(4)]
        assert len(joined) == 1 and joined[0].group(1) == "INFO"
        # from the join on, every line has the node's rank
        after = parsed[parsed.index(joined[0]):]
        assert {m.group(3) for m in after} == {str(r)}, log


def test_json_lines_and_the_level_switch(make_cluster):
    c = make_cluster(2, 1, ["--log_format=json", "--log_level=warning", "--sparsifier=micro"])
    assert lines(c, 0) == lines(c, 1) == []  # nothing at warning or above in a healthy start
    c2 = make_cluster(2, 1, ["--log_format=json"])
    for r in range(2):
        objs = [json.loads(x) for x in lines(c2, r)]
        assert objs and all(set(o) == {"time", "level", "node", "rank", "source", "message"}
                            for o in objs)
        assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$", o["time"]) for o in objs)
        ranked = [o for o in objs if o["rank"] is not None]
        assert ranked and all(o["rank"] == r and o["node"] == f"node{r}" for o in ranked)
        assert any("is rank" in o["message"] and o["level"] == "info" for o in objs)
