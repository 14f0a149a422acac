/* The error record every layer fills; the first cause wins. */
#include <stdarg.h>
#include <stdio.h>

#include "common/error.h"

void rr_set_error(rr_error *err, int code, int rank, const char *fmt, ...)
{
    if (!err || err->code != RR_OK) return;
    va_list ap;
    va_start(ap, fmt);
    err->code = code;
    err->rank = rank;
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
}

int rr_aborted_error(rr_error *err)
{
    rr_set_error(err, RR_E_PEER_LOST, -1, "transport was aborted after an earlier error");
    return err ? err->code : RR_E_PEER_LOST;
}
