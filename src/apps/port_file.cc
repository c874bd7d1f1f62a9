#include "apps/port_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace kvbridge::apps {

Status WritePortFile(const std::string& path, int port) {
  if (port < 1 || port > 65535) {
    return InvalidArgumentError("port file " + path + ": port " + std::to_string(port) +
                                " out of range");
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << port << "\n";
    f.flush();
    if (!f) return UnavailableError("cannot write port file " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return UnavailableError("cannot rename " + tmp + " to " + path + ": " + std::strerror(err));
  }
  return OkStatus();
}

Result<int> ReadPortFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFoundError("no port file " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  int port = 0;
  size_t i = 0;
  for (; i < s.size() && i < 6 && s[i] >= '0' && s[i] <= '9'; ++i) port = port * 10 + (s[i] - '0');
  if (i == 0 || i >= s.size() || s[i] != '\n' || i + 1 != s.size() || port < 1 || port > 65535) {
    return InvalidArgumentError("port file " + path + " does not hold one port number");
  }
  return port;
}

}  // namespace kvbridge::apps
