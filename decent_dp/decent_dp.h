// Everything a trainer needs: the wrappers, the communicator, topologies, optimizers,
// schedulers and their factories.
#pragma once

#include "decent_dp/decent_optim_wrapper.h"
#include "decent_dp/decentralized_data_parallel.h"
#include "decent_dp/distributed_data_parallel.h"
#include "decent_dp/mpi_communicator.h"
#include "optim/adam.h"
#include "optim/factories.h"
#include "optim/schedulers.h"
#include "optim/sgd.h"
#include "topology/topology.h"
