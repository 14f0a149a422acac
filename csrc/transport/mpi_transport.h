/* MPI transport: the same ring schedule over MPI point-to-point messages on
 * any communicator (process sets: several independent rings in one job). */
#ifndef RINGREDUCE_MPI_TRANSPORT_H
#define RINGREDUCE_MPI_TRANSPORT_H

#include <mpi.h>

#include "transport/transport.h"

/* Duplicates comm, so the ring's messages never meet the caller's. NULL on
 * failure. timeout_s: how long a peer may stay silent. pids: every rank's
 * process id (copied), where all ranks share this host's pid namespace, so
 * that a wait in the host arena sees a dead peer at once; else NULL. */
rr_transport *rr_mpi_create(MPI_Comm comm, double timeout_s, const int *pids);

#endif
