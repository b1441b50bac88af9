"""The aggregator: Flower's FedAvg, and the global model evaluated after every round with
edge-fl's own evaluation; the end of each round and the final accuracy go to ``out-file``."""

from __future__ import annotations

import json
import time

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from edge_fl.models import evaluate, make_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    with np.load(f"{cfg['data-dir']}/server.npz") as server:
        w0, X_test, y_test = server["w0"], server["X_test"], server["y_test"]
    model = make_model("mlp", X_test.shape[1], int(cfg["n-classes"]), hidden=int(cfg["hidden"]))
    ends: list[float] = []  # perf_counter at the end of each round's evaluation
    accuracy: list[float] = []

    def evaluate_global(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        acc, loss = evaluate(model, arrays.to_numpy_ndarrays()[0], X_test, y_test)
        if server_round > 0:  # round 0 is the initial model
            ends.append(time.perf_counter())
            accuracy.append(acc)
        return MetricRecord({"accuracy": acc, "loss": loss})

    devices, per_round = int(cfg["devices"]), int(cfg["clients-per-round"])
    strategy = FedAvg(
        fraction_train=per_round / devices,
        min_train_nodes=per_round,
        min_available_nodes=devices,  # wait for the whole fleet, as edge-fl does
        fraction_evaluate=0.0,  # no federated evaluation: the server evaluates, as edge-fl's does
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([w0]),
        num_rounds=int(cfg["num-rounds"]),
        evaluate_fn=evaluate_global,
    )
    result = {"round_ends": ends, "accuracy": accuracy}
    with open(str(cfg["out-file"]), "w") as f:
        json.dump(result, f)
