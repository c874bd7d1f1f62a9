// src/apps/port_file.h — how a child tells `kvbridge up` the port it really bound.
//
// `kvbridge serve` and `kvbridge proxy` take `--port 0 --port-file PATH`: they bind any free
// port, then write it to PATH. `up` reads the file back instead of choosing ports itself, so no
// other process can take a port between its choice and the child's bind (the race that a
// pick-then-bind scheme has under concurrent tests).
//
//   // child, once listening:
//   RETURN_IF_ERROR(WritePortFile(opts.port_file, server->port()));
//   // parent, polling:
//   Result<int> port = ReadPortFile(path);  // NotFound until the child has bound
#pragma once

#include <string>

#include "kvbridge/common/status.h"

namespace kvbridge::apps {

/// Writes `port` (1..65535) and a newline to `path`: to `path.tmp` first, then renamed, so a
/// reader never sees a partial number. InvalidArgument for a port out of range; Unavailable when
/// the file cannot be written. Thread-compatible.
Status WritePortFile(const std::string& path, int port);

/// Reads a file written by WritePortFile. NotFound while it does not exist; InvalidArgument when
/// its content is not one port number (1..65535) and a newline.
Result<int> ReadPortFile(const std::string& path);

}  // namespace kvbridge::apps
