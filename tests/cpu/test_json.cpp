// The one JSON reader/writer of the project (src/common/json.h), shared by the calibration
// code and the `sage` command.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

#include "common/json.h"

namespace {

using namespace sage;

TEST(Json, ReadsWhatPythonsJsonModuleWrites) {
  const JsonValue doc = parse_json(
      R"([{"impl": "sagekit", "tops": 601.5, "causal": false, "cosine": NaN,)"
      R"( "hi": Infinity, "lo": -Infinity, "note": "a\"b\u00e9", "none": null}])");
  ASSERT_EQ(doc.kind, JsonValue::array);
  const JsonValue& r = doc.items.at(0);
  EXPECT_EQ(r.get("impl")->str, "sagekit");
  EXPECT_EQ(r.get("tops")->num, 601.5);
  EXPECT_EQ(r.get("causal")->kind, JsonValue::boolean);
  EXPECT_FALSE(r.get("causal")->b);
  EXPECT_TRUE(std::isnan(r.get("cosine")->num));
  EXPECT_EQ(r.get("hi")->num, INFINITY);
  EXPECT_EQ(r.get("lo")->num, -INFINITY);
  EXPECT_EQ(r.get("note")->str, "a\"b\xc3\xa9");
  EXPECT_EQ(r.get("none")->kind, JsonValue::null);
  EXPECT_EQ(r.get("missing"), nullptr);
}

TEST(Json, MalformedInputNamesTheByteOffset) {
  try {
    parse_json("{\"a\": [1, 2,, 3]}");
    FAIL() << "malformed JSON was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("byte"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_json("[1] trailing"), std::runtime_error);
}

TEST(Json, NumbersAndStringsRoundTrip) {
  for (double v : {0.1, 1.0 / 3.0, 646.0123456789, -2.5e-300, 1e300}) {
    EXPECT_EQ(parse_json(json_number(v)).num, v) << json_number(v);
  }
  EXPECT_EQ(json_number(NAN), "null");
  const std::string s = "tab\tquote\"back\\slash\x01";
  EXPECT_EQ(parse_json(json_string(s)).str, s);
}

}  // namespace
