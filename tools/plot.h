// Heatmap PNGs of what a sparse method selects: cells shaded from light grey (nothing kept) to
// dark blue (all kept), white where the query cannot see, needles ringed (green when the method
// kept them, red when it missed them) with a tick above their key column, a header and axis
// labels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparse_attn::cli {

struct Heatmap {
  int64_t rows = 0, cols = 0;
  std::vector<float> value;  // [rows * cols]: kept fraction in [0, 1]; < 0: not visible
  struct Mark {
    int64_t row, col;
    bool kept;
  };
  std::vector<Mark> marks;          // needles
  std::vector<std::string> header;  // lines above the map: title, sizes, legend
  std::string x_label, y_label;
  std::string x_first, x_last;  // labels of the first and last column
  std::string y_first, y_last;  // labels of the first and last row
};

// Writes the heatmap as a PNG (ValueError naming the path when it cannot be written).
void write_heatmap_png(const std::string& path, const Heatmap& map);

// "out.png" -> "out-qsa.png" (for several methods in one run).
std::string plot_path_for(const std::string& path, const std::string& method);

}  // namespace sparse_attn::cli
