"""`serve --quantization int8` serves the quantized model: the engine behind the HTTP server runs int8 modules,
and the line it prints as it starts says which weights it serves."""
import pytest

from minillm.cli import main
from minillm.quantize import WeightOnlyInt8Linear, quantization_of
from minillm.serving import launch


@pytest.mark.parametrize("flags, served", [([], None), (["--quantization", "int8"], "int8")])
def test_serve_builds_its_engine_on_the_model_in_the_weights_asked_for(capsys, monkeypatch, flags, served):
    seen = {}

    class NoListening:  # the server as built, minus the port: what it would serve is what the test reads
        def __init__(self, serving, config):
            seen["engine"], self.started = serving.loop.engine, True

        def run(self):
            pass
    monkeypatch.setattr(launch, "Server", NoListening)
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--threads", "1", *flags]) == 0
    model = seen["engine"].model
    assert quantization_of(model) == served
    assert any(isinstance(m, WeightOnlyInt8Linear) for m in model.modules()) == (served == "int8")
    banner = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("serving tiny"))
    assert ("float32, int8 weights)" if served else "float32)") in banner, banner
