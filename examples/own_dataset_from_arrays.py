"""Your own data in a federated job: numpy arrays split over devices, label-skewed.

``FederatedDataset.from_arrays`` takes train and test arrays (rows are flattened: images work
too) and splits the training rows over the devices: "iid", "dirichlet" (each device sees few
classes; smaller alpha, fewer) or your own list of row indices per device.

    python examples/own_dataset_from_arrays.py
"""

import numpy as np

import edge_fl

# three Gaussian blobs in 2-D: a stand-in for the arrays you already have
rng = np.random.default_rng(0)
centres = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])
labels = rng.integers(0, 3, size=1200)
points = centres[labels] + rng.normal(size=(1200, 2))
x_train, y_train, x_test, y_test = points[:1000], labels[:1000], points[1000:], labels[1000:]

data = edge_fl.FederatedDataset.from_arrays(
    x_train, y_train, x_test, y_test, devices=8, partition="dirichlet", alpha=0.3, name="blobs"
)
for device in range(3):
    _, y = data.device_data(device)
    print(f"device {device}: {len(y)} rows, labels {np.bincount(y, minlength=3).tolist()}")

cfg = edge_fl.load_config(
    None,
    {
        "job": "own-dataset",
        "model.name": "logreg",
        "rounds.rounds": 5,
        "rounds.clients_per_round": 8,
        "training.lr": 0.1,
    },
)
job = edge_fl.build_job(cfg, dataset=data)  # data.devices and data.dataset come from `data`
result = edge_fl.run_simulation(job)
print(f"dataset {result.summary['dataset']} on {result.summary['devices']} devices")
print(f"final accuracy {result.summary['final_accuracy']:.3f}")
