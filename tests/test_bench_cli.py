"""The benchmark command line on a machine without CUDA: options are parsed and checked, and a GPU
benchmark says it needs CUDA instead of failing somewhere inside."""
import pytest
import torch

from kda_compile.bench.__main__ import main
from kda_compile.bench.kda import prefill_shapes


def test_prefill_shapes_parse():
    assert prefill_shapes("1x8192x32, 8X1024x64") == [(1, 8192, 32), (8, 1024, 64)]


@pytest.mark.parametrize("text", ["1x8192", "1x0x32", "axbxc", "1x8192x32,"])
def test_bad_prefill_shapes_name_the_item(text, capsys):
    with pytest.raises(SystemExit):
        main(["kda", "--shapes", text])
    assert "shapes must be BxTxH items" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("name", ["kda", "mla"])
def test_gpu_benchmarks_say_they_need_cuda(name, tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main([name, "--csv", str(tmp_path / "out.csv")])
