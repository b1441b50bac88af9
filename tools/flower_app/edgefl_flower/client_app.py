"""A device: edge-fl's local SGD on its own shard, from the global model it is sent."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from edge_fl.models import make_model
from edge_fl.models.training import LocalTraining, local_sgd

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    device = int(context.node_config["partition-id"])
    with np.load(f"{cfg['data-dir']}/device-{device}.npz") as shard:
        X, y = shard["X"], shard["y"]
    model = make_model("mlp", X.shape[1], int(cfg["n-classes"]), hidden=int(cfg["hidden"]))
    training = LocalTraining(int(cfg["epochs"]), int(cfg["batch-size"]), float(cfg["lr"]))
    w = msg.content["arrays"].to_numpy_ndarrays()[0]
    # a fresh generator per device and round (a ClientApp process lives for one message)
    server_round = int(msg.content["config"]["server-round"])
    rng = np.random.default_rng([int(cfg["seed"]), device, server_round])
    trained = local_sgd(model, w, X, y, training, rng)
    content = RecordDict(
        {"arrays": ArrayRecord([trained]), "metrics": MetricRecord({"num-examples": len(y)})}
    )
    return Message(content=content, reply_to=msg)
