// The tests' one check of a refusal: the call throws sage::Error naming `argument`, and (when
// given) its message contains `phrase`. For the messages' form (one sentence, the argument
// first), test_args.cpp and test_recipes.cpp check more on top of it.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "sage/error.h"

namespace sage::testing {

template <class Call>
void expect_refusal(Call&& call, const std::string& argument, const std::string& phrase = "") {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    if (!phrase.empty()) EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
  }
}

}  // namespace sage::testing

// expect_refusal with the call site in the failure's trace: EXPECT_REFUSAL(f(a), "q", "dtype").
// An empty phrase checks the argument alone.
#define EXPECT_REFUSAL(call, argument, phrase)                                   \
  do {                                                                           \
    SCOPED_TRACE(#call);                                                         \
    ::sage::testing::expect_refusal([&] { (void)(call); }, argument, phrase);    \
  } while (0)
