"""`serve --quantization int8|w8a8` serves the quantized model: the engine behind the HTTP server runs its modules,
and the line it prints as it starts says which weights it serves."""
import pytest

from minillm.cli import main
from minillm.quantize import W8A8Int8Linear, WeightOnlyInt8Linear, quantization_of
from minillm.serving import launch


@pytest.mark.parametrize("flags, served", [([], None), (["--quantization", "int8"], "int8"),
                                           (["--quantization", "w8a8"], "w8a8")])
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
    assert any(isinstance(m, WeightOnlyInt8Linear) for m in model.modules()) == (served is not None)
    assert any(isinstance(m, W8A8Int8Linear) for m in model.modules()) == (served == "w8a8")
    banner = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("serving tiny"))
    assert (f"float32, {served} weights)" if served else "float32)") in banner, banner
