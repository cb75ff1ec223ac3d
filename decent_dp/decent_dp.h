// Everything a trainer needs: the wrappers, the communicator, topologies, optimizers,
// schedulers and their factories.
#pragma once

#include "decent_dp/compensated_codec.h"
#include "decent_dp/decent_optim_wrapper.h"
#include "decent_dp/decentralized_data_parallel.h"
#include "decent_dp/distributed_data_parallel.h"
#include "decent_dp/metrics.h"
#include "decent_dp/mpi_communicator.h"
#include "decent_dp/optim/adam.h"
#include "decent_dp/optim/factories.h"
#include "decent_dp/optim/schedulers.h"
#include "decent_dp/optim/sgd.h"
#include "decent_dp/pre_mixing.h"
#include "decent_dp/privacy.h"
#include "decent_dp/quantize_codec.h"
#include "decent_dp/stream_codec.h"
#include "decent_dp/topology/topology.h"
