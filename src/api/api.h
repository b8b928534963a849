#ifndef BLADE_API_API_H
#define BLADE_API_API_H

/* The OpenAI protocol, shared by `blade serve` and `blade batch`: request bodies of
 * /v1/completions and /v1/chat/completions are validated into engine requests (request.h),
 * engine events are carried off the engine thread (sink.h) and gathered per choice, and the
 * response objects, stream chunks, usage and error objects are built in OpenAI's shapes
 * (job.h, error.h). It knows nothing of HTTP: the server and the batch runner move its
 * bytes. This header brings in the whole protocol; a module that needs one part includes
 * that part's header. */

#include "api/buf.h"
#include "api/error.h"
#include "api/job.h"
#include "api/model.h"
#include "api/request.h"
#include "api/sink.h"

#endif
