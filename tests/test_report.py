"""`kvcal report`: each row is compared only with the fp16 record of the same model, dataset, protocol, seqlen and
windows."""

from kvcal.eval.report import markdown_table


def record(method, ppl, nsamples, protocol="gptq", seqlen=2048, model="smollm2-135m"):
    return {"setting": f"{method}-{nsamples}", "method": method, "ppl": ppl, "bits_per_element": 16.0 if method ==
            "fp16" else 2.5, "protocol": protocol, "nsamples": nsamples, "seqlen": seqlen, "model": {"name": model},
            "dataset": {"dataset": "wikitext2", "split": "wiki.test.raw"}, "device": "cpu"}


def deltas(records):
    rows = markdown_table(records).splitlines()[2:]
    return {r.split(" | ")[0].lstrip("| "): r.split(" | ")[3] for r in rows}


def test_rows_compare_with_the_matching_fp16_record_only():
    records = [record("fp16", 20.0, 8), record("fp16", 25.0, 16), record("kivi", 30.0, 16), record("kivi", 22.0, 8),
               record("rtn", 40.0, 16, protocol="prefill-decode"), record("rtn", 50.0, 16, seqlen=1024)]
    got = deltas(records)
    assert got["fp16-8"] == "+0.0%" and got["fp16-16"] == "+0.0%"  # not +25% against the 8-window fp16
    assert got["kivi-16"] == "+20.0%"  # 30 / 25
    assert got["kivi-8"] == "+10.0%"  # 22 / 20
    rtn = [line for line in markdown_table(records).splitlines() if line.startswith("| rtn-16")]
    assert [line.split(" | ")[3] for line in rtn] == ["", ""]  # no fp16 of that protocol or seqlen: no comparison
